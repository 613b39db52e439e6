// keyqueue dashboard: live updates without a reload (progressive enhancement; the pages work without it).
// Listens to /live (server-sent events) and, on each "refresh", replaces the page's live region
// with the same URL's ?fragment=1. Keeps <details> that were open, open.
(function () {
  "use strict";
  var region = document.getElementById("live");
  if (!region || !region.hasAttribute("data-live") || !window.EventSource) { return; }
  var busy = false;
  function fragmentUrl() {
    var url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    url.searchParams.delete("done");
    return url.toString();
  }
  function refresh() {
    if (busy) { return; }
    busy = true;
    var open = Array.prototype.map.call(region.querySelectorAll("details[open]"), function (d) {
      var row = d.closest("[data-seq]");
      return row ? row.getAttribute("data-seq") : null;
    });
    fetch(fragmentUrl(), { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) { return; }
        region.innerHTML = html;
        open.forEach(function (seq) {
          var d = seq && region.querySelector('[data-seq="' + seq + '"] details');
          if (d) { d.open = true; }
        });
        document.body.setAttribute("data-live-version", String(Date.now()));
      })
      .catch(function () { /* the next refresh tries again */ })
      .then(function () { busy = false; });
  }
  var source = new EventSource("/live");
  source.addEventListener("refresh", refresh);
  document.body.setAttribute("data-live", "connected");
})();

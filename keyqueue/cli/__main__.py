from keyqueue.cli import main

main()

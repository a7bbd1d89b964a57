from kvsim.cli import main

main()

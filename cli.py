from simkv.cli import main

main()

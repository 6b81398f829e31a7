from mosaicd.cli import main

main()

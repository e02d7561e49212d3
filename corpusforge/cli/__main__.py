from corpusforge.cli import main

main()

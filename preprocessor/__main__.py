from preprocessor.main import main

main()

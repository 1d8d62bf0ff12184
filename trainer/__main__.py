from trainer.main import main

main()

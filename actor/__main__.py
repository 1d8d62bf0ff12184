from actor.main import main

main()

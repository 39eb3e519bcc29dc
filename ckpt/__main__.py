from ckpt.cli.main import main

main()

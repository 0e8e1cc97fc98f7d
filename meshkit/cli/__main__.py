from meshkit.cli.main import run

run()

"""`python -m precast` runs the CLI, the same as the `precast` command."""

from precast.cli.main import main

if __name__ == "__main__":
    main()

"""``python -m graphbuild``: the command line."""

from graphbuild.cli.app import main

if __name__ == "__main__":
    main()

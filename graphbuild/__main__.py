"""``python -m graphbuild``: the command line, through the build server when one is wanted
(:mod:`graphbuild.server.client`)."""

from graphbuild.server.client import main

if __name__ == "__main__":
    main()

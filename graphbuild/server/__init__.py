"""The build server: warm processes that keep torch, graphbuild and the user's libraries
imported and the user's built models in memory, so that a command pays for its stages only.

The design is the client/server split of Bazel, Gradle's daemon, sccache and dmypy:

* :mod:`~graphbuild.server.client` is the ``graphbuild`` command itself. It imports nothing
  heavy: it connects to the server of this user and this Python environment over a Unix
  socket (mode 0600, in ``$XDG_RUNTIME_DIR`` or a 0700 directory under the temporary
  directory; :mod:`~graphbuild.server.paths`), starting it when none answers (under a lock
  file, so concurrent first commands start one), sends the command line, working directory
  and environment with its own stdin, stdout and stderr (file descriptors passed over the
  socket, so output streams straight to the terminal) and exits with the command's code. When
  no server can be started, with ``--no-server``, ``GRAPHBUILD_SERVER=0``, in CI or under
  pytest, it runs the command in-process as before.
* :mod:`~graphbuild.server.daemon` is the server: it imports the export machinery once, then
  forks one *project process* per working directory and ``sys.path`` (so one project's
  modules never leak into another's), restarts itself when graphbuild or the installed
  libraries change, and exits when idle.
* :mod:`~graphbuild.server.project` is a project process: it forks one *request process* per
  command (:mod:`~graphbuild.server.request`; a request that crashes takes nothing else with
  it) and keeps the models its requests built (:mod:`~graphbuild.server.memo`): a request
  whose model is not memoized, or whose memoized model is stale, hands the config to the
  project process, which builds it (recording every file the factory opens) and forks the
  request again. A memoized model is valid while the files the build read have the same
  contents; an edited module of the project restarts the project process.
* :mod:`~graphbuild.server.warm` hands the code closures a request computed back to its
  project process, and :mod:`~graphbuild.server.watch` is ``export --watch``.

The Python API is untouched: only the command line goes through the server.
"""

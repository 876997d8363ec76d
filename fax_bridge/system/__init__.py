"""The operating system's side: processes forked from a warm interpreter (`forks`,
`fork_server`, `fork_protocol`, kept together: they load each other by path where
the package is not imported), process trees, private files and output folders,
npz files handed over, HOST:PORT addresses, `FAX_BRIDGE_*` settings, the
checked command-line arguments every subcommand shares, and packages' names served
on first use (`lazy_names`).
"""

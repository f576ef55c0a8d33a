"""The `mpilb` command: argument parsing and subcommands (main), and `mpilb doctor`.
"""

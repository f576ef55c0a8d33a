"""A run's configuration: the option table (options), the typed sections (sections), the one
place every check lives (validate), the builder from command line and TOML (build) and the
generated reference (reference).
"""

"""Tandem's cluster layer: start/connect, the Serve app, the CLI, metrics and config."""

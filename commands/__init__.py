"""The command-line subcommands of `specvoice` (everything but the browser app, which lives in app/)."""

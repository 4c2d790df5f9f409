"""CLI subcommands; one module each, imported lazily by ``evenpipe.cli``."""

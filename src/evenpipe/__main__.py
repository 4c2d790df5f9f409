from evenpipe.cli import entry

entry()

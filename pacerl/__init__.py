"""pacerl: the front door (command, run configuration)."""

"""precast's command line: thin click commands, each calling one library function."""

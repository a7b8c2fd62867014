"""Built-in model and cluster descriptions, one TOML file each (see pipedsl.simulator.hardware)."""

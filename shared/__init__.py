"""meshllm's common library: protocol, codec, bus, service config, admin app, metrics, logs."""

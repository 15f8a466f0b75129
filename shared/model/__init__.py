"""The served model: where its files are, its config, and GGUF reading and conversion."""

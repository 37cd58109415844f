"""deployrl: RL post-training of language models against the engine you deploy."""

__version__ = "0.1.0"

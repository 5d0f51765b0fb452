"""Errors the whole library raises; a leaf module (it imports nothing of ours), so the pure
decoding layer can raise the same ConfigError the config layer does."""


class ConfigError(ValueError):
    """A user error in the config: the message names the key. The jobs print it as one line and
    exit with code 2."""

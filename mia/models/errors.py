"""The error every family raises on a config.json it cannot reproduce exactly (re-exported by ``common``)."""


class ConfigError(ValueError):
    """A checkpoint's config.json asks for something we cannot reproduce exactly."""

"""Errors zoo raises on bad input. Each message names the key, the file and what was expected."""


class ZooError(Exception):
    """Base class of every error zoo raises for bad input."""


class ConfigError(ZooError):
    """A config that does not compose or validate: unknown key, wrong type, inconsistent dims."""


class CheckpointError(ZooError):
    """A checkpoint that does not fit the config: unmapped tensor, unfilled parameter, bad shape."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint file that is not well-formed (docs/security.md): a header, length, offset, size or
    type that the format does not allow, or metadata that contradicts the file's own tensors. Raised
    from the header alone, before anything is allocated; the message names the file, the field and
    what was expected."""


class InputError(ZooError):
    """Runtime input that the built model cannot take: prompt too long, batch too large, bad id."""


class PluginError(ZooError):
    """A plugin (compiler/plugins.py: an entry point of the group `zoo.kinds` or a module the user
    conf dir's plugins.yaml lists) that cannot be used: a bad plugins.yaml, a module that fails to
    import or registers no kind, or a kind it registers that breaks its slot's contract or takes a
    built-in kind's name. The message names where the plugin was named and the module."""


class ContractError(TypeError):
    """A kind class that does not meet its slot's contract (compiler/contracts/): a bug in that kind's
    module, reported when the module is imported."""

"""What every Python process of the suite does first: in the test process (conftest) and in every
process the tests start (``child_site/sitecustomize.py``, on their PYTHONPATH).

mmengine's config formatting and metafile parsing are memoized: both are pure functions of inputs
that do not change during a test session, and both dominate building a small Runner or loading a
config with ``mmdet::`` / ``mmseg::`` bases. seaborn, which mmdet imports for plots no test
draws, is imported when first used instead.
"""
import functools
import importlib
import importlib.abc
import importlib.util
import os
import sys
import types

CONFIG_MODULE = 'mmengine.config.config'


def memoize_config_formatting(mmengine_config) -> None:
    """mmengine formats a config's text with yapf (``Config.pretty_text``) four to five times per
    Runner (the logged and the dumped config, the message hub, every checkpoint's meta). yapf's
    ``FormatCode`` is a pure function of the text and the style: each result is kept per
    (text, style), the same strings, formatted once per process."""
    format_code = mmengine_config.FormatCode

    @functools.lru_cache(maxsize=256)
    def formatted(text, style):
        return format_code(text, style_config=dict(style))

    def memoized(text, style_config=None, **kwargs):
        if kwargs or not isinstance(style_config, dict):
            return format_code(text, style_config=style_config, **kwargs)
        return formatted(text, tuple(sorted(style_config.items())))

    mmengine_config.FormatCode = memoized


def memoize_package_metafiles(mmengine_config, config_utils) -> None:
    """Each ``mmdet::`` / ``mmseg::`` base makes mmengine check that the package is installed
    (reloading ``pkg_resources``) and parse every metafile its ``model-index.yml`` lists. Both
    read installed files that do not change during a session: each metafile is parsed once per
    process (keyed by its path and modification time), and a package found installed stays so."""
    load = config_utils.load

    @functools.lru_cache(maxsize=512)
    def parsed(path, mtime_ns):
        return load(path)

    def cached_load(file, *args, **kwargs):
        if args or kwargs or not isinstance(file, str) or not file.endswith(('.yml', '.yaml')):
            return load(file, *args, **kwargs)
        return parsed(file, os.stat(file).st_mtime_ns)

    config_utils.load = cached_load
    is_installed = mmengine_config.is_installed
    installed = set()

    def cached_is_installed(package):
        if package not in installed and is_installed(package):
            installed.add(package)
        return package in installed

    mmengine_config.is_installed = cached_is_installed


def memoize(mmengine_config) -> None:
    memoize_config_formatting(mmengine_config)
    memoize_package_metafiles(mmengine_config, sys.modules['mmengine.config.utils'])


class _AfterConfigImport(importlib.abc.MetaPathFinder):
    """Memoizes right after mmengine's config module is imported: a process that never imports
    mmengine pays nothing (several tests measure a fresh process's memory)."""

    def find_spec(self, name, path=None, target=None):
        if name != CONFIG_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_memoize(module):
            exec_module(module)
            memoize(module)

        spec.loader.exec_module = exec_then_memoize
        return spec


class _ImportedOnFirstUse(types.ModuleType):
    """Stands in for a module until one of its attributes is asked for. It has ``__file__``:
    ``inspect.getmodule``, which torch calls while registering its operators, reads the
    ``__file__`` of every module loaded."""

    def __getattr__(self, attr):
        del sys.modules[self.__name__]
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)  # for those that bound the stand-in
        return getattr(module, attr)


def import_on_first_use(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if name not in sys.modules and spec is not None:
        stand_in = _ImportedOnFirstUse(name)
        stand_in.__file__, stand_in.__spec__ = spec.origin, spec
        sys.modules[name] = stand_in


def install() -> None:
    """seaborn imported on first use; ``memoize`` now if mmengine's config module is loaded,
    else as soon as it is."""
    import_on_first_use('seaborn')
    if CONFIG_MODULE in sys.modules:
        memoize(sys.modules[CONFIG_MODULE])
    else:
        sys.meta_path.insert(0, _AfterConfigImport())

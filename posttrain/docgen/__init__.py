"""Renderers of the generated references (``docs/config.md``, ``docs/methods.md``) and the
``posttrain algorithms`` catalog, read from the live config classes and registries.
"""

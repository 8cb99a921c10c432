"""Recipe schema v1, YAML loading and validation messages."""

from llmc.recipe.load import load_recipe, parse_recipe
from llmc.recipe.schema import Recipe

__all__ = ["Recipe", "load_recipe", "parse_recipe"]

"""Recipe schema v1 (`schema`: `Recipe`), YAML loading and validation messages (`load`: `load_recipe`,
`parse_recipe`), `--set` overrides (`overrides`). This file imports nothing: its modules import each other, and
importing any of them imports this package first, so re-exporting them here would be an import cycle."""

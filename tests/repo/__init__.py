"""The repository's own rules: documented commands against the parser, the import layering, no path
outside the checkout, the process markers' check, the GPU check script."""

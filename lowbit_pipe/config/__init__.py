"""From recipe text to a checked config: composition (Hydra / OmegaConf, one-line errors), what text from outside
may hold (untrusted), checks against the registries (validate), checks that need no weights (preflight), --help."""

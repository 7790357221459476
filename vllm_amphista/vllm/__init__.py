"""Everything that touches vLLM: the patches, the config validation, and one module per method
(its proposer and, for Amphista, its vLLM model). The rest of the package imports no vLLM."""

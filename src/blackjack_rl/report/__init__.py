"""Pages and console tables a person reads: the dataset view, evaluation summaries."""

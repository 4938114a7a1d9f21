"""The runtime behind the graph ops: parameter registry, gathered-buffer lifetime, gradient reduction."""

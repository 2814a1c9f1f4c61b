"""The node agent: notice sources, the node handler and the NVMe model cache."""

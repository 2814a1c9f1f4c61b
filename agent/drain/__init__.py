"""What is done about a notice: the handler, the pure drain plan, evictions, node actions, the notice board."""

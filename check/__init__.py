"""`spotdrain check`: what is wrong with an install, read from the cluster."""

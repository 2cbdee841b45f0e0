"""What surrounds fusion: torch modules, data sets, client training, simulation, evaluation and
the demo. The toolkit imports the core, the engine and the methods; none of them imports it."""

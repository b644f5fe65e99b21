"""Which method for a network: the alpha-beta network model, every method ranked by predicted step
(:func:`jaxcomp.advise`), and the fastest plan that holds accuracy (:func:`jaxcomp.auto`)."""

"""Tools around the optimizer, apart from its core: the memory and communication estimator
(`estimate`, `estimate_links`), the two-node testbed (`testbed`, `testbed_results`) and the
demo models and data (`models`). Nothing in the optimizer imports them."""

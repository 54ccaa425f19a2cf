"""A stage's data, for the driver (which counts and checks it before training) and the ranks (which train on
it): records read from files, folders and hub names, their fingerprints, samples and prompts tokenized as
OpenRLHF's datasets make them, and the seeded order of batches. Imports storage and the shared modules only."""

"""Operations: what a person watching a run sees and keeps (the console, alerts, the goodput ledger, metric
trackers). Imports storage and the shared modules, never a rank's or the driver's code."""

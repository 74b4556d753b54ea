//! strata-snapshotter

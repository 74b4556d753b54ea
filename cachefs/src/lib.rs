//! strata-cachefs

//! Placeholder target so cargo accepts the manifest; never compiled.

"""Private helpers of `advisor.search`: the default space, backends, the ledger of measured candidates, storage."""

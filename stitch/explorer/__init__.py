"""The fusion explorer: PatternReduction, remote fusion, beam search and the BLP planner."""

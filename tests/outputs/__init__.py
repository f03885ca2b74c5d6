"""A session's followers: taps, watch links, recordings and their replays."""

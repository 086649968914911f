"""pddlink.wire"""

"""pddlink.kv"""
